output "checkpoint_dir" {
  description = "Where the job checkpoints (SPOTGUARD_CHECKPOINT_DIR); inspect it with `spotguard ls`."
  value       = local.checkpoint_dir
}

output "bucket_name" {
  description = "The checkpoint bucket."
  value       = aws_s3_bucket.checkpoints.bucket
}

output "autoscaling_group_name" {
  description = "The spot Auto Scaling group running the job."
  value       = aws_autoscaling_group.training.name
}

output "launch_template_id" {
  description = "Launch template of the training instances."
  value       = aws_launch_template.training.id
}

output "instance_role_arn" {
  description = "IAM role of the training instances (scoped to the checkpoint prefix)."
  value       = aws_iam_role.training.arn
}

output "security_group_id" {
  description = "Security group of the training instances."
  value       = aws_security_group.training.id
}

output "rdzv_endpoint" {
  description = "The torchrun c10d rendezvous endpoint."
  value       = module.startup.rdzv_endpoint
}

output "fis_experiment_template_id" {
  description = "FIS experiment template of the interruption drill; null unless enable_fis_drill."
  value       = one(aws_fis_experiment_template.spot_interruption[*].id)
}

output "drill_command" {
  description = "Command that runs the interruption drill; null unless enable_fis_drill."
  value       = var.enable_fis_drill ? "aws fis start-experiment --experiment-template-id ${aws_fis_experiment_template.spot_interruption[0].id}" : null
}

output "startup_script" {
  description = "The rendered user data (bash), for review."
  value       = module.startup.script
}
