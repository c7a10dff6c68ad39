resource "google_storage_bucket" "checkpoints" {
  project                     = var.project_id
  name                        = "${var.name}-ckpt-${random_id.bucket_suffix.hex}"
  location                    = var.bucket_location
  force_destroy               = var.force_destroy
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  labels                      = local.labels
  #checkov:skip=CKV_GCP_62:checkpoint bucket of one job; access logs are left to Cloud Audit Logs data access logging

  versioning {
    enabled = true
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]
    content {
      default_kms_key_name = encryption.value
    }
  }

  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_retention_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }
}

resource "random_id" "bucket_suffix" {
  byte_length = 4
}

# The job's service account may read, write and delete objects of this bucket only.
resource "google_storage_bucket_iam_member" "training" {
  bucket = google_storage_bucket.checkpoints.name
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.training.email}"
}
