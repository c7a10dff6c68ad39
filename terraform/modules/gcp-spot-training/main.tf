locals {
  checkpoint_prefix = var.checkpoint_prefix != "" ? var.checkpoint_prefix : var.name
  checkpoint_dir    = "gs://${google_storage_bucket.checkpoints.name}/${local.checkpoint_prefix}"
  labels            = merge(var.labels, { spotguard-job = var.name })
}

module "startup" {
  source = "../spotguard-startup"

  cloud          = "gcp"
  job_name       = var.name
  checkpoint_dir = local.checkpoint_dir
  nodes          = var.nodes
  job            = var.job
  environment    = var.environment
}

resource "google_service_account" "training" {
  project      = var.project_id
  account_id   = "${substr(var.name, 0, 22)}-train"
  display_name = "spotguard job ${var.name}"
}

resource "google_compute_instance_template" "training" {
  project      = var.project_id
  name_prefix  = "${var.name}-"
  description  = "spotguard job ${var.name} on Spot VMs"
  machine_type = var.machine_type
  labels       = local.labels
  tags         = ["spotguard-${var.name}"]

  scheduling {
    provisioning_model          = "SPOT"
    preemptible                 = true
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE"
    instance_termination_action = var.instance_termination_action
  }

  guest_accelerator {
    type  = var.gpu_type
    count = var.gpu_count
  }

  disk {
    source_image = var.source_image
    disk_size_gb = var.boot_disk_size_gb
    disk_type    = "pd-balanced"
    boot         = true
    auto_delete  = true
    labels       = local.labels
  }

  network_interface {
    subnetwork = var.subnetwork
    #checkov:skip=CKV_GCP_40:no public IP unless assign_public_ip is set for a subnetwork without Cloud NAT

    dynamic "access_config" {
      for_each = var.assign_public_ip ? [1] : []
      content {}
    }
  }

  service_account {
    email  = google_service_account.training.email
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    # Secure Boot would refuse the unsigned NVIDIA kernel modules the image installs.
    enable_secure_boot          = false
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    startup-script         = module.startup.script
    install-nvidia-driver  = "True"
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_instance_group_manager" "training" {
  project            = var.project_id
  name               = "${var.name}-mig"
  zone               = var.zone
  base_instance_name = var.name
  target_size        = var.nodes
  description        = "spotguard job ${var.name}: recreates preempted Spot VMs"

  version {
    instance_template = google_compute_instance_template.training.self_link_unique
  }

  update_policy {
    type                  = "OPPORTUNISTIC"
    minimal_action        = "REPLACE"
    max_surge_fixed       = 0
    max_unavailable_fixed = 1
  }
}
