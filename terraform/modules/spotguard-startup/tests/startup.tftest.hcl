# Provider-free checks of the rendered startup script: terraform init -backend=false && terraform test

variables {
  cloud          = "gcp"
  job_name       = "llm-run"
  checkpoint_dir = "gs://ckpt-bucket/llm-run"
  nodes          = 1
}

run "single_node_defaults" {
  command = plan

  assert {
    condition     = output.rdzv_endpoint == "localhost:29400"
    error_message = "one node rendezvous on localhost"
  }

  assert {
    condition     = startswith(output.script, "#!/usr/bin/env bash\n") && strcontains(output.script, "CLOUD='gcp'")
    error_message = "the script must be bash and watch the cloud it was rendered for"
  }

  assert {
    condition     = strcontains(output.script, "export SPOTGUARD_CHECKPOINT_DIR='gs://ckpt-bucket/llm-run'")
    error_message = "the script must export SPOTGUARD_CHECKPOINT_DIR"
  }
}

run "quotes_user_values" {
  command = plan

  variables {
    job         = { train_args = ["--note", "it's fine"] }
    environment = { NCCL_DEBUG = "INFO" }
  }

  assert {
    condition     = strcontains(output.script, "TRAIN_ARGS=('--note' 'it'\\''s fine' )") && strcontains(output.script, "export NCCL_DEBUG='INFO'")
    error_message = "arguments and environment must be single-quoted for bash"
  }
}

run "several_nodes_need_a_rendezvous_host" {
  command = plan

  variables {
    nodes = 2
  }

  expect_failures = [output.script]
}

run "rejects_unknown_cloud" {
  command = plan

  variables {
    cloud = "oracle"
  }

  expect_failures = [var.cloud]
}

run "rejects_bad_nproc" {
  command = plan

  variables {
    job = { nproc_per_node = "many" }
  }

  expect_failures = [var.job]
}
