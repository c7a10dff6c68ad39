locals {
  # One node needs no external rendezvous host; several must agree on one.
  rdzv_endpoint = var.job.rdzv_endpoint != "" ? var.job.rdzv_endpoint : "localhost:29400"
  # Elastic (README "Elastic training"): survivors train on down to min_nodes.
  elastic = var.job.min_nodes > 0 && var.job.min_nodes < var.nodes

  script = templatefile("${path.module}/startup.sh.tftpl", {
    cloud            = var.cloud
    job_name         = var.job_name
    checkpoint_dir   = var.checkpoint_dir
    nnodes           = local.elastic ? "${var.job.min_nodes}:${var.nodes}" : tostring(var.nodes)
    min_nodes        = local.elastic ? var.job.min_nodes : 0
    environment      = var.environment
    train_script     = var.job.train_script
    train_args       = var.job.train_args
    pip_packages     = var.job.pip_packages
    python           = var.job.python
    code_repo_url    = var.job.code_repo_url
    code_ref         = var.job.code_ref
    nproc_per_node   = var.job.nproc_per_node
    rdzv_endpoint    = local.rdzv_endpoint
    max_restarts     = var.job.max_restarts
    watch_interval_s = var.job.watch_interval_s
    requeue_grace_s  = var.job.requeue_grace_s
    in_process       = var.job.in_process
  })
}
