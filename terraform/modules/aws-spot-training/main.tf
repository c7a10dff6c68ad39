locals {
  checkpoint_prefix = var.checkpoint_prefix != "" ? var.checkpoint_prefix : var.name
  checkpoint_dir    = "s3://${aws_s3_bucket.checkpoints.bucket}/${local.checkpoint_prefix}"
  ami_id            = var.ami_id != null ? var.ami_id : data.aws_ssm_parameter.ami[0].insecure_value
  tags              = merge(var.tags, { "spotguard:job" = var.name })
}

data "aws_partition" "current" {}

data "aws_region" "current" {}

data "aws_subnet" "first" {
  id = var.subnet_ids[0]
}

data "aws_ssm_parameter" "ami" {
  count = var.ami_id == null ? 1 : 0
  name  = var.ami_ssm_parameter
}

module "startup" {
  source = "../spotguard-startup"

  cloud          = "aws"
  job_name       = var.name
  checkpoint_dir = local.checkpoint_dir
  nodes          = var.nodes
  job            = var.job
  environment    = merge({ AWS_DEFAULT_REGION = data.aws_region.current.name }, var.environment)
}

resource "aws_security_group" "training" {
  name_prefix = "${var.name}-"
  description = "spotguard job ${var.name}: rendezvous and NCCL between its nodes, egress for pip and S3"
  vpc_id      = data.aws_subnet.first.vpc_id
  tags        = local.tags

  ingress {
    description = "c10d rendezvous and NCCL between the nodes of this job"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    self        = true
  }

  #checkov:skip=CKV_AWS_382:nodes install packages from PyPI and reach S3 over HTTPS; egress is not narrowed to prefixes
  egress {
    description = "pip, S3 and the instance metadata service"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_launch_template" "training" {
  name_prefix            = "${var.name}-"
  description            = "spotguard job ${var.name}"
  image_id               = local.ami_id
  key_name               = var.key_name
  user_data              = base64encode(module.startup.script)
  update_default_version = true
  vpc_security_group_ids = [aws_security_group.training.id]
  tags                   = local.tags

  iam_instance_profile {
    arn = aws_iam_instance_profile.training.arn
  }

  #checkov:skip=CKV_AWS_341:hop limit 2 lets containers on the node reach IMDSv2; tokens stay required
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
    instance_metadata_tags      = "enabled"
  }

  block_device_mappings {
    device_name = var.root_device_name

    ebs {
      volume_size           = var.root_volume_size_gb
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.tags, { Name = var.name })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }
}

resource "aws_autoscaling_group" "training" {
  name_prefix         = "${var.name}-"
  min_size            = var.nodes
  max_size            = var.nodes
  desired_capacity    = var.nodes
  vpc_zone_identifier = var.subnet_ids
  # Launch a replacement as soon as EC2 signals elevated risk, before the 2-minute notice.
  capacity_rebalance        = true
  health_check_type         = "EC2"
  health_check_grace_period = 600

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 0
      spot_allocation_strategy                 = "price-capacity-optimized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.training.id
        version            = aws_launch_template.training.latest_version
      }

      dynamic "override" {
        for_each = var.instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  dynamic "tag" {
    for_each = merge(local.tags, { Name = var.name })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
