output "checkpoint_dir" {
  description = "Where the job checkpoints (SPOTGUARD_CHECKPOINT_DIR); inspect it with `spotguard ls`."
  value       = local.checkpoint_dir
}

output "bucket_name" {
  description = "The checkpoint bucket."
  value       = google_storage_bucket.checkpoints.name
}

output "instance_group_manager" {
  description = "Name of the managed instance group running the job."
  value       = google_compute_instance_group_manager.training.name
}

output "instance_template" {
  description = "Self link of the Spot instance template."
  value       = google_compute_instance_template.training.self_link_unique
}

output "service_account_email" {
  description = "Service account of the VMs (objectAdmin on the checkpoint bucket only)."
  value       = google_service_account.training.email
}

output "rdzv_endpoint" {
  description = "The torchrun c10d rendezvous endpoint."
  value       = module.startup.rdzv_endpoint
}

output "drill_command" {
  description = "Simulates a host maintenance event on one VM of the group: a Spot VM with on_host_maintenance TERMINATE is shut down and recreated."
  value       = "gcloud compute instances simulate-maintenance-event $(gcloud compute instance-groups managed list-instances ${google_compute_instance_group_manager.training.name} --zone ${var.zone} --project ${var.project_id} --format='value(name)' --limit 1) --zone ${var.zone} --project ${var.project_id}"
}

output "startup_script" {
  description = "The rendered startup-script metadata (bash), for review."
  value       = module.startup.script
}
