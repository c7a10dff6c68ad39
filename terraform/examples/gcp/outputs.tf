output "checkpoint_dir" {
  description = "Checkpoint location of the job."
  value       = module.training.checkpoint_dir
}

output "instance_group_manager" {
  description = "The managed instance group."
  value       = module.training.instance_group_manager
}

output "drill_command" {
  description = "Simulates a maintenance event on one VM of the group."
  value       = module.training.drill_command
}
