variable "name" {
  description = "Name of the training job; prefixes every resource and is the torchrun rendezvous id."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,30}[a-z0-9]$", var.name))
    error_message = "name must be 2-32 characters of lowercase letters, digits and dashes, starting with a letter."
  }
}

variable "resource_group_name" {
  description = "Existing resource group for every resource of the job."
  type        = string

  validation {
    condition     = trimspace(var.resource_group_name) != ""
    error_message = "resource_group_name must not be empty."
  }
}

variable "location" {
  description = "Azure region, e.g. eastus; it must offer the VM size as Spot."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9]+$", var.location))
    error_message = "location must be a region name such as eastus."
  }
}

variable "subnet_id" {
  description = "Subnet of the scale set. It needs outbound internet (NAT gateway) for pip and the Microsoft.Storage service endpoint: the storage account only admits this subnet."
  type        = string

  validation {
    condition     = can(regex("/subnets/[^/]+$", var.subnet_id))
    error_message = "subnet_id must be the resource id of a subnet."
  }
}

variable "vm_size" {
  description = "GPU VM size, e.g. Standard_NC4as_T4_v3, Standard_NC24ads_A100_v4."
  type        = string
  default     = "Standard_NC4as_T4_v3"

  validation {
    condition     = can(regex("^Standard_[A-Za-z0-9_]+$", var.vm_size))
    error_message = "vm_size must be an Azure size such as Standard_NC4as_T4_v3."
  }
}

variable "nodes" {
  description = "Number of VMs (torchrun --nnodes). The scale set keeps this many and replaces evicted ones."
  type        = number
  default     = 1

  validation {
    condition     = var.nodes >= 1 && var.nodes <= 256 && floor(var.nodes) == var.nodes
    error_message = "nodes must be a whole number between 1 and 256."
  }
}

variable "eviction_policy" {
  description = "What Azure does to an evicted VM: Delete (the scale set creates a new one) or Deallocate (kept, you restart it)."
  type        = string
  default     = "Delete"

  validation {
    condition     = contains(["Delete", "Deallocate"], var.eviction_policy)
    error_message = "eviction_policy must be Delete or Deallocate."
  }
}

variable "admin_username" {
  description = "Admin user of the VMs (SSH key only)."
  type        = string
  default     = "azureuser"

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.admin_username)) && !contains(["root", "admin", "administrator"], var.admin_username)
    error_message = "admin_username must be a valid Linux user name other than root/admin/administrator."
  }
}

variable "admin_ssh_public_key" {
  description = "OpenSSH public key for the admin user."
  type        = string

  validation {
    condition     = can(regex("^(ssh-rsa|ssh-ed25519|ecdsa-sha2-nistp[0-9]+) ", var.admin_ssh_public_key))
    error_message = "admin_ssh_public_key must be an OpenSSH public key."
  }
}

variable "source_image" {
  description = "Marketplace image; the default Ubuntu HPC image ships the NVIDIA driver and CUDA for N-series VMs."
  type = object({
    publisher = string
    offer     = string
    sku       = string
    version   = string
  })
  default = {
    publisher = "microsoft-dsvm"
    offer     = "ubuntu-hpc"
    sku       = "2204"
    version   = "latest"
  }
}

variable "os_disk_size_gb" {
  description = "OS disk size; holds the venv, the CUDA wheels and the local checkpoint staging."
  type        = number
  default     = 200

  validation {
    condition     = var.os_disk_size_gb >= 64 && var.os_disk_size_gb <= 4095
    error_message = "os_disk_size_gb must be between 64 and 4095."
  }
}

variable "encryption_at_host" {
  description = "Encrypt temp disks and caches at the host (needs the EncryptionAtHost feature registered on the subscription)."
  type        = bool
  default     = false
}

variable "job" {
  description = "What to run: training script and arguments, pip packages, torchrun settings. See the spotguard-startup module for every field; all are optional."
  type = object({
    train_script     = optional(string, "examples/train_ddp.py")
    train_args       = optional(list(string), [])
    pip_packages     = optional(list(string), ["spotguard[azure]"])
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

variable "checkpoint_prefix" {
  description = "Blob prefix of the checkpoints inside the container; empty means the job name."
  type        = string
  default     = ""

  validation {
    condition     = can(regex("^([A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*)?$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must be a relative prefix without leading or trailing slash."
  }
}

variable "noncurrent_version_retention_days" {
  description = "Days an overwritten or deleted checkpoint blob (an old step pruned by spotguard) stays recoverable."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_retention_days >= 1 && var.noncurrent_version_retention_days <= 365
    error_message = "noncurrent_version_retention_days must be between 1 and 365."
  }
}

variable "storage_replication_type" {
  description = "Replication of the checkpoint storage account (LRS, ZRS, GRS, ...)."
  type        = string
  default     = "ZRS"

  validation {
    condition     = contains(["LRS", "ZRS", "GRS", "RAGRS", "GZRS", "RAGZRS"], var.storage_replication_type)
    error_message = "storage_replication_type must be LRS, ZRS, GRS, RAGRS, GZRS or RAGZRS."
  }
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
