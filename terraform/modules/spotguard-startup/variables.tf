variable "cloud" {
  description = "Cloud the VM runs on; selects the metadata source of `spotguard watch --cloud`."
  type        = string

  validation {
    condition     = contains(["aws", "gcp", "azure"], var.cloud)
    error_message = "cloud must be one of aws, gcp, azure."
  }
}

variable "job_name" {
  description = "Name of the training job; also the torchrun rendezvous id, so every node of one job must share it."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,30}[a-z0-9]$", var.job_name))
    error_message = "job_name must be 2-32 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "checkpoint_dir" {
  description = "Object-store URL the job checkpoints to (s3://, gs:// or az://); exported as SPOTGUARD_CHECKPOINT_DIR and passed as --checkpoint-dir."
  type        = string

  validation {
    condition     = can(regex("^(s3|gs|az)://[^/]+(/.*)?$", var.checkpoint_dir))
    error_message = "checkpoint_dir must be an s3://, gs:// or az:// URL."
  }
}

variable "nodes" {
  description = "Number of VMs (torchrun --nnodes)."
  type        = number

  validation {
    condition     = var.nodes >= 1 && var.nodes <= 256 && floor(var.nodes) == var.nodes
    error_message = "nodes must be a whole number between 1 and 256."
  }
}

variable "environment" {
  description = "Extra environment variables for the watcher and the training job (cloud-specific credentials hints, NCCL settings)."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.environment) : can(regex("^[A-Za-z_][A-Za-z0-9_]*$", k))])
    error_message = "environment keys must be valid shell variable names."
  }
}

variable "job" {
  description = <<-EOT
    What to run and how:
    - train_script: path of the training script, relative to the code checkout (or absolute). It must accept `--checkpoint-dir DIR`.
    - train_args: extra arguments for the training script (e.g. ["--steps", "20000"]).
    - pip_packages: pip requirement specs installed into /opt/spotguard/venv (spotguard itself, your own deps).
    - python: interpreter the venv is built from (`--system-site-packages`, so an image's preinstalled torch is reused).
    - code_repo_url / code_ref: git repository (and branch or tag) cloned into /opt/spotguard/work; empty means no clone.
    - nproc_per_node: torchrun --nproc-per-node: a number, "gpu", "auto" or "cpu".
    - rdzv_endpoint: host:port of the c10d rendezvous; required for more than one node, localhost:29400 otherwise.
    - max_restarts: torchrun --max-restarts (worker-group restarts on the same VM before torchrun gives up; under elastic training each reclaim of another node uses one).
    - min_nodes: elastic training: torchrun --nnodes=MIN_NODES:NODES; when a VM is reclaimed the others train on while at least this many remain, and the job grows back when the replacement joins. 0 (default) or NODES: not elastic.
    - watch_interval_s: polling interval of the `spotguard watch` sidecar.
    - requeue_grace_s: after the job stops because of an interruption notice, how long to wait for the VM to be reclaimed before resuming on this VM (a rebalance recommendation does not always end in a reclaim).
    - in_process: the training script runs under spotguard.run (examples/train_ddp.py: add "--in-process" to train_args), with snapshots on (SPOTGUARD_SNAPSHOT_EVERY in environment, say). The job's rank 0 records its store's address at the rendezvous endpoint, and a VM that boots while the job runs joins it without restarting the other nodes' processes (`spotguard join-address`); otherwise, or when the job refuses it, it starts through the rendezvous as usual.
  EOT
  type = object({
    train_script     = optional(string, "examples/train_ddp.py")
    train_args       = optional(list(string), [])
    pip_packages     = optional(list(string), ["spotguard"])
    python           = optional(string, "python3")
    code_repo_url    = optional(string, "")
    code_ref         = optional(string, "")
    nproc_per_node   = optional(string, "gpu")
    rdzv_endpoint    = optional(string, "")
    max_restarts     = optional(number, 2)
    min_nodes        = optional(number, 0)
    watch_interval_s = optional(number, 1)
    requeue_grace_s  = optional(number, 300)
    in_process       = optional(bool, false)
  })
  default = {}

  validation {
    condition     = trimspace(var.job.train_script) != ""
    error_message = "job.train_script must not be empty."
  }
  validation {
    condition     = length(var.job.pip_packages) > 0
    error_message = "job.pip_packages must list at least the spotguard package."
  }
  validation {
    condition     = can(regex("^(gpu|auto|cpu|[1-9][0-9]*)$", var.job.nproc_per_node))
    error_message = "job.nproc_per_node must be a positive number, \"gpu\", \"auto\" or \"cpu\"."
  }
  validation {
    condition     = var.job.rdzv_endpoint == "" || can(regex("^[A-Za-z0-9.-]+:[0-9]{1,5}$", var.job.rdzv_endpoint))
    error_message = "job.rdzv_endpoint must be host:port."
  }
  validation {
    condition     = var.job.max_restarts >= 0 && var.job.max_restarts <= 100 && floor(var.job.max_restarts) == var.job.max_restarts
    error_message = "job.max_restarts must be a whole number between 0 and 100."
  }
  validation {
    condition     = var.job.min_nodes >= 0 && floor(var.job.min_nodes) == var.job.min_nodes
    error_message = "job.min_nodes must be a whole number, 0 for a job that is not elastic."
  }
  validation {
    condition     = var.job.watch_interval_s > 0 && var.job.watch_interval_s <= 60
    error_message = "job.watch_interval_s must be between 0 and 60 seconds."
  }
  validation {
    condition     = var.job.requeue_grace_s >= 0 && var.job.requeue_grace_s <= 3600
    error_message = "job.requeue_grace_s must be between 0 and 3600 seconds."
  }
}
