output "checkpoint_dir" {
  description = "Where the job checkpoints (SPOTGUARD_CHECKPOINT_DIR); inspect it with `spotguard ls` (with AZURE_STORAGE_ACCOUNT set)."
  value       = local.checkpoint_dir
}

output "storage_account_name" {
  description = "The checkpoint storage account (AZURE_STORAGE_ACCOUNT)."
  value       = azurerm_storage_account.checkpoints.name
}

output "container_name" {
  description = "The checkpoint container."
  value       = azurerm_storage_container.checkpoints.name
}

output "scale_set_name" {
  description = "The Spot scale set running the job."
  value       = azurerm_linux_virtual_machine_scale_set.training.name
}

output "identity_client_id" {
  description = "Client id of the VMs' managed identity (AZURE_CLIENT_ID)."
  value       = azurerm_user_assigned_identity.training.client_id
}

output "rdzv_endpoint" {
  description = "The torchrun c10d rendezvous endpoint."
  value       = module.startup.rdzv_endpoint
}

output "drill_command" {
  description = "Evicts one VM of the scale set (instance 0; list ids with az vmss list-instances)."
  value       = "az vmss simulate-eviction --resource-group ${var.resource_group_name} --name ${azurerm_linux_virtual_machine_scale_set.training.name} --instance-id 0"
}

output "startup_script" {
  description = "The rendered custom data (bash), for review."
  value       = module.startup.script
}
