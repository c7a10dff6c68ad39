variable "region" {
  description = "AWS region to deploy into."
  type        = string
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.region))
    error_message = "region must look like us-east-1."
  }
}

variable "name" {
  description = "Name of the training job."
  type        = string
  default     = "spotguard-demo"
}

variable "subnet_ids" {
  description = "Private subnets (with NAT) in several AZs of one VPC."
  type        = list(string)
}

variable "instance_types" {
  description = "Single-GPU instance types the spot group may use."
  type        = list(string)
  default     = ["g5.xlarge", "g6.xlarge", "g4dn.xlarge", "g5.2xlarge", "g6.2xlarge"]
}

variable "code_repo_url" {
  description = "Git repository holding the training script (examples/train_ddp.py)."
  type        = string
  default     = "https://github.com/spotguard/spotguard.git"
}

variable "steps" {
  description = "Training steps (passed as --steps)."
  type        = number
  default     = 20000

  validation {
    condition     = var.steps >= 1 && floor(var.steps) == var.steps
    error_message = "steps must be a positive whole number."
  }
}

variable "enable_fis_drill" {
  description = "Create the FIS spot interruption drill."
  type        = bool
  default     = true
}
