variable "name" {
  description = "Name of the training job; prefixes every resource and is the torchrun rendezvous id."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,30}[a-z0-9]$", var.name))
    error_message = "name must be 2-32 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "project_id" {
  description = "Project that runs the job."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a GCP project id."
  }
}

variable "zone" {
  description = "Zone of the managed instance group; it must offer the GPU type (gcloud compute accelerator-types list)."
  type        = string

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone must look like us-central1-a."
  }
}

variable "bucket_location" {
  description = "Location of the checkpoint bucket; keep it in the zone's region to avoid egress charges."
  type        = string
}

variable "subnetwork" {
  description = "Self link or name of the subnetwork; it needs Cloud NAT (pip) and Private Google Access (GCS) when instances have no public IP."
  type        = string

  validation {
    condition     = trimspace(var.subnetwork) != ""
    error_message = "subnetwork must not be empty."
  }
}

variable "machine_type" {
  description = "Machine type; N1 types take attached GPUs (gpu_type), G2/A2/A3 types come with theirs (set gpu_type and gpu_count to match)."
  type        = string
  default     = "n1-standard-8"

  validation {
    condition     = can(regex("^[a-z][a-z0-9]*-[a-z0-9-]+$", var.machine_type))
    error_message = "machine_type must look like n1-standard-8 or g2-standard-8."
  }
}

variable "gpu_type" {
  description = "Accelerator type (guest_accelerator), e.g. nvidia-tesla-t4, nvidia-l4, nvidia-tesla-a100."
  type        = string
  default     = "nvidia-tesla-t4"

  validation {
    condition     = can(regex("^nvidia-[a-z0-9-]+$", var.gpu_type))
    error_message = "gpu_type must be an nvidia-... accelerator type."
  }
}

variable "gpu_count" {
  description = "GPUs per VM."
  type        = number
  default     = 1

  validation {
    condition     = contains([1, 2, 4, 8, 16], var.gpu_count)
    error_message = "gpu_count must be 1, 2, 4, 8 or 16."
  }
}

variable "nodes" {
  description = "Number of VMs (torchrun --nnodes). The group keeps this many and recreates preempted ones."
  type        = number
  default     = 1

  validation {
    condition     = var.nodes >= 1 && var.nodes <= 256 && floor(var.nodes) == var.nodes
    error_message = "nodes must be a whole number between 1 and 256."
  }
}

variable "instance_termination_action" {
  description = "What GCP does to a preempted VM: STOP keeps the disk (faster restart, the group starts it again), DELETE discards it."
  type        = string
  default     = "STOP"

  validation {
    condition     = contains(["STOP", "DELETE"], var.instance_termination_action)
    error_message = "instance_termination_action must be STOP or DELETE."
  }
}

variable "job" {
  description = "What to run: training script and arguments, pip packages, torchrun settings. See the spotguard-startup module for every field; all are optional."
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
  })
  default = {}
}

variable "environment" {
  description = "Extra environment variables for the job (e.g. NCCL settings)."
  type        = map(string)
  default     = {}
}

variable "source_image" {
  description = "Boot image; the default Deep Learning VM family ships CUDA and installs the NVIDIA driver on first boot (install-nvidia-driver metadata)."
  type        = string
  default     = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310"
}

variable "boot_disk_size_gb" {
  description = "Boot disk size; holds the venv, the CUDA wheels and the local checkpoint staging."
  type        = number
  default     = 200

  validation {
    condition     = var.boot_disk_size_gb >= 50 && var.boot_disk_size_gb <= 65536
    error_message = "boot_disk_size_gb must be between 50 and 65536."
  }
}

variable "assign_public_ip" {
  description = "Give the VMs an ephemeral public IP (only when the subnetwork has no Cloud NAT)."
  type        = bool
  default     = false
}

variable "checkpoint_prefix" {
  description = "Object prefix of the checkpoints inside the bucket; empty means the job name."
  type        = string
  default     = ""

  validation {
    condition     = can(regex("^([A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*)?$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must be a relative prefix without leading or trailing slash."
  }
}

variable "noncurrent_version_retention_days" {
  description = "Days an overwritten or deleted checkpoint object (an old step pruned by spotguard) stays recoverable."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_retention_days >= 1 && var.noncurrent_version_retention_days <= 3650
    error_message = "noncurrent_version_retention_days must be between 1 and 3650."
  }
}

variable "kms_key_name" {
  description = "Cloud KMS key for the bucket (CMEK); null uses Google-managed encryption."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket with its checkpoints in it."
  type        = bool
  default     = false
}

variable "labels" {
  description = "Labels for every resource that takes them."
  type        = map(string)
  default     = {}
}
