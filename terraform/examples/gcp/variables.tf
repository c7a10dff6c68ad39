variable "project_id" {
  description = "Project to deploy into."
  type        = string
}

variable "region" {
  description = "Region of the bucket and the subnetwork."
  type        = string
  default     = "us-central1"
}

variable "zone" {
  description = "Zone of the VMs (must offer the GPU type)."
  type        = string
  default     = "us-central1-a"
}

variable "subnetwork" {
  description = "Subnetwork with Cloud NAT and Private Google Access."
  type        = string
}

variable "name" {
  description = "Name of the training job."
  type        = string
  default     = "spotguard-demo"
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
