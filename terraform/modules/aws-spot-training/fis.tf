# Interruption drill: AWS FIS sends a real spot interruption notice (then terminates) to one
# instance of the group. Off by default; enable_fis_drill = true creates it.

data "aws_iam_policy_document" "fis_assume" {
  count = var.enable_fis_drill ? 1 : 0

  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["fis.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "fis" {
  count = var.enable_fis_drill ? 1 : 0

  statement {
    sid       = "InterruptThisGroupOnly"
    actions   = ["ec2:SendSpotInstanceInterruptions"]
    resources = ["arn:${data.aws_partition.current.partition}:ec2:*:*:instance/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/spotguard:job"
      values   = [var.name]
    }
  }

  statement {
    sid       = "FindTargets"
    actions   = ["ec2:DescribeInstances"]
    resources = ["*"]
  }
}

resource "aws_iam_role" "fis" {
  count              = var.enable_fis_drill ? 1 : 0
  name_prefix        = "${var.name}-fis-"
  description        = "AWS FIS: send spot interruptions to the instances of ${var.name}"
  assume_role_policy = data.aws_iam_policy_document.fis_assume[0].json
  tags               = local.tags
}

resource "aws_iam_role_policy" "fis" {
  count  = var.enable_fis_drill ? 1 : 0
  name   = "spot-interruptions"
  role   = aws_iam_role.fis[0].id
  policy = data.aws_iam_policy_document.fis[0].json
}

resource "aws_fis_experiment_template" "spot_interruption" {
  count       = var.enable_fis_drill ? 1 : 0
  description = "Spot interruption drill for ${var.name}"
  role_arn    = aws_iam_role.fis[0].arn
  tags        = merge(local.tags, { Name = "${var.name}-spot-interruption" })

  stop_condition {
    source = "none"
  }

  action {
    name      = "interrupt-one-node"
    action_id = "aws:ec2:send-spot-instance-interruptions"

    parameter {
      key   = "durationBeforeInterruption"
      value = var.fis_interruption_delay
    }

    target {
      key   = "SpotInstances"
      value = "training-node"
    }
  }

  target {
    name           = "training-node"
    resource_type  = "aws:ec2:spot-instance"
    selection_mode = "COUNT(1)"

    resource_tag {
      key   = "aws:autoscaling:groupName"
      value = aws_autoscaling_group.training.name
    }

    filter {
      path   = "State.Name"
      values = ["running"]
    }
  }
}
