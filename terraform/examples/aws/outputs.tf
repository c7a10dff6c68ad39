output "checkpoint_dir" {
  description = "Checkpoint location of the job."
  value       = module.training.checkpoint_dir
}

output "autoscaling_group_name" {
  description = "The spot Auto Scaling group."
  value       = module.training.autoscaling_group_name
}

output "drill_command" {
  description = "Starts the spot interruption drill."
  value       = module.training.drill_command
}
