output "checkpoint_dir" {
  description = "Checkpoint location of the job."
  value       = module.training.checkpoint_dir
}

output "storage_account_name" {
  description = "Storage account holding the checkpoints (AZURE_STORAGE_ACCOUNT)."
  value       = module.training.storage_account_name
}

output "drill_command" {
  description = "Evicts one VM of the scale set."
  value       = module.training.drill_command
}
