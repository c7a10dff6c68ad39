resource "aws_s3_bucket" "checkpoints" {
  bucket_prefix = "${var.name}-ckpt-"
  force_destroy = var.force_destroy
  tags          = local.tags
  #checkov:skip=CKV_AWS_18:checkpoint bucket of one job; access logging is left to the account's CloudTrail data events
  #checkov:skip=CKV_AWS_144:checkpoints are reproducible working state; cross-region replication would double storage cost
  #checkov:skip=CKV2_AWS_62:nothing consumes checkpoint events; add a notification where a pipeline needs one
}

resource "aws_s3_bucket_public_access_block" "checkpoints" {
  bucket                  = aws_s3_bucket.checkpoints.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_versioning" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  # Rules apply to versioned objects: wait for versioning to be on.
  depends_on = [aws_s3_bucket_versioning.checkpoints]

  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }

  rule {
    id     = "expire-pruned-steps"
    status = "Enabled"

    filter {
      prefix = "${local.checkpoint_prefix}/"
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_retention_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  dynamic "rule" {
    for_each = var.checkpoint_expiration_days > 0 ? [var.checkpoint_expiration_days] : []
    content {
      id     = "expire-checkpoints"
      status = "Enabled"

      filter {
        prefix = "${local.checkpoint_prefix}/"
      }

      expiration {
        days = rule.value
      }
    }
  }
}

data "aws_iam_policy_document" "deny_insecure_transport" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.checkpoints.arn, "${aws_s3_bucket.checkpoints.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "checkpoints" {
  bucket     = aws_s3_bucket.checkpoints.id
  policy     = data.aws_iam_policy_document.deny_insecure_transport.json
  depends_on = [aws_s3_bucket_public_access_block.checkpoints]
}
