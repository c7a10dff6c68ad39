variable "name" {
  description = "Name of the training job; prefixes every resource and is the torchrun rendezvous id."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,30}[a-z0-9]$", var.name))
    error_message = "name must be 2-32 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "subnet_ids" {
  description = "Subnets the instances may launch in (one VPC; list several AZs to widen the spot pools). They need a route to the internet (NAT) for pip, and to S3."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) > 0 && alltrue([for s in var.subnet_ids : can(regex("^subnet-[0-9a-f]+$", s))])
    error_message = "subnet_ids must hold at least one subnet id (subnet-...)."
  }
}

variable "instance_types" {
  description = "GPU instance types the group may use, as mixed-instances overrides. Several similar types (same GPU count) give price-capacity-optimized more pools to choose from."
  type        = list(string)
  default     = ["g5.xlarge", "g6.xlarge", "g4dn.xlarge", "g5.2xlarge", "g6.2xlarge"]

  validation {
    condition     = length(var.instance_types) > 0 && alltrue([for t in var.instance_types : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", t))])
    error_message = "instance_types must hold at least one instance type such as g5.xlarge."
  }
}

variable "nodes" {
  description = "Number of instances (torchrun --nnodes). The group keeps this many running and replaces reclaimed ones."
  type        = number
  default     = 1

  validation {
    condition     = var.nodes >= 1 && var.nodes <= 256 && floor(var.nodes) == var.nodes
    error_message = "nodes must be a whole number between 1 and 256."
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

variable "ami_id" {
  description = "AMI to boot. Null means the newest AWS Deep Learning Base OSS Nvidia Driver GPU AMI, read from ami_ssm_parameter."
  type        = string
  default     = null

  validation {
    condition     = var.ami_id == null || can(regex("^ami-[0-9a-f]+$", var.ami_id))
    error_message = "ami_id must be null or an AMI id (ami-...)."
  }
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter holding the default AMI id (used when ami_id is null)."
  type        = string
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"

  validation {
    condition     = startswith(var.ami_ssm_parameter, "/")
    error_message = "ami_ssm_parameter must be an SSM parameter path starting with /."
  }
}

variable "root_volume_size_gb" {
  description = "Size of the encrypted gp3 root volume; holds the venv, the CUDA wheels and the local checkpoint staging."
  type        = number
  default     = 200

  validation {
    condition     = var.root_volume_size_gb >= 50 && var.root_volume_size_gb <= 16384
    error_message = "root_volume_size_gb must be between 50 and 16384."
  }
}

variable "root_device_name" {
  description = "Root device name of the AMI (/dev/sda1 for Ubuntu, /dev/xvda for Amazon Linux)."
  type        = string
  default     = "/dev/sda1"

  validation {
    condition     = can(regex("^/dev/(sd|xvd)[a-z][0-9]*$", var.root_device_name))
    error_message = "root_device_name must look like /dev/sda1 or /dev/xvda."
  }
}

variable "checkpoint_prefix" {
  description = "Key prefix of the checkpoints inside the bucket; empty means the job name."
  type        = string
  default     = ""

  validation {
    condition     = can(regex("^([A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*)?$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must be a relative key prefix without leading or trailing slash."
  }
}

variable "noncurrent_version_retention_days" {
  description = "Days an overwritten or deleted checkpoint object (an old step pruned by spotguard) stays recoverable before S3 deletes it."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_retention_days >= 1 && var.noncurrent_version_retention_days <= 3650
    error_message = "noncurrent_version_retention_days must be between 1 and 3650."
  }
}

variable "checkpoint_expiration_days" {
  description = "Days after which every checkpoint object expires; 0 keeps them until spotguard or you prune them."
  type        = number
  default     = 0

  validation {
    condition     = var.checkpoint_expiration_days >= 0 && var.checkpoint_expiration_days <= 3650
    error_message = "checkpoint_expiration_days must be between 0 and 3650."
  }
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key for the bucket and the root volume; null uses the AWS-managed keys (aws/s3, aws/ebs)."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:", var.kms_key_arn))
    error_message = "kms_key_arn must be null or a KMS key ARN."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket with its checkpoints in it."
  type        = bool
  default     = false
}

variable "key_name" {
  description = "EC2 key pair for SSH; null means none (use SSM Session Manager)."
  type        = string
  default     = null
}

variable "enable_ssm" {
  description = "Attach AmazonSSMManagedInstanceCore so you can open a shell with Session Manager."
  type        = bool
  default     = true
}

variable "enable_fis_drill" {
  description = "Create an AWS FIS experiment template that sends a spot interruption notice to one instance of the group."
  type        = bool
  default     = false
}

variable "fis_interruption_delay" {
  description = "Time between the FIS interruption notice and the termination (ISO 8601 duration, 2 to 15 minutes; real spot gives 2)."
  type        = string
  default     = "PT2M"

  validation {
    condition     = can(regex("^PT([2-9]|1[0-5])M$", var.fis_interruption_delay))
    error_message = "fis_interruption_delay must be PT2M ... PT15M."
  }
}

variable "tags" {
  description = "Tags for every resource (and propagated to the instances)."
  type        = map(string)
  default     = {}
}
