variable "location" {
  description = "Azure region (must offer the VM size as Spot)."
  type        = string
  default     = "eastus"
}

variable "name" {
  description = "Name of the training job."
  type        = string
  default     = "spotguard-demo"
}

variable "admin_ssh_public_key" {
  description = "OpenSSH public key for the VMs' admin user."
  type        = string
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
