output "script" {
  description = "The rendered startup script (bash): user data, startup-script metadata or custom data."
  value       = local.script

  precondition {
    condition     = var.nodes == 1 || var.job.rdzv_endpoint != ""
    error_message = "job.rdzv_endpoint must name a host:port every node can reach when nodes > 1."
  }
}

output "rdzv_endpoint" {
  description = "The c10d rendezvous endpoint the job uses."
  value       = local.rdzv_endpoint
}
