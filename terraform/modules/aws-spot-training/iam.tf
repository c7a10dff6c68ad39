data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "training" {
  name_prefix        = "${var.name}-"
  description        = "spotguard job ${var.name}: read and write its checkpoint prefix"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

# Only this job's prefix of this bucket: list it, read, write, delete (pruning) and abort uploads.
data "aws_iam_policy_document" "checkpoints" {
  statement {
    sid       = "ListCheckpointPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.checkpoints.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [local.checkpoint_prefix, "${local.checkpoint_prefix}/*"]
    }
  }

  statement {
    sid = "ReadWriteCheckpoints"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${aws_s3_bucket.checkpoints.arn}/${local.checkpoint_prefix}/*"]
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]
    content {
      sid       = "UseCheckpointKey"
      actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role_policy" "checkpoints" {
  name   = "checkpoints"
  role   = aws_iam_role.training.id
  policy = data.aws_iam_policy_document.checkpoints.json
}

resource "aws_iam_role_policy_attachment" "ssm" {
  count      = var.enable_ssm ? 1 : 0
  role       = aws_iam_role.training.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "training" {
  name_prefix = "${var.name}-"
  role        = aws_iam_role.training.name
  tags        = local.tags
}
