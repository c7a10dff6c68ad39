# Plan-only checks with a mocked AWS provider: no account, no network.
# Run from this module: terraform init -backend=false && terraform test

mock_provider "aws" {
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }

  mock_data "aws_region" {
    defaults = {
      name = "us-east-1"
    }
  }

  # bucket_prefix makes the name unknown until apply; a fixed name lets plan runs read the user data.
  mock_resource "aws_s3_bucket" {
    override_during = plan
    defaults = {
      bucket = "llm-run-ckpt-test"
      arn    = "arn:aws:s3:::llm-run-ckpt-test"
    }
  }

  mock_data "aws_partition" {
    defaults = {
      partition = "aws"
    }
  }
}

variables {
  name       = "llm-run"
  subnet_ids = ["subnet-0123456789abcdef0", "subnet-0fedcba9876543210"]
  job = {
    train_args = ["--steps", "1000"]
  }
}

run "spot_fleet" {
  command = plan

  assert {
    condition     = aws_autoscaling_group.training.mixed_instances_policy[0].instances_distribution[0].spot_allocation_strategy == "price-capacity-optimized"
    error_message = "the group must allocate spot with price-capacity-optimized"
  }

  assert {
    condition     = aws_autoscaling_group.training.mixed_instances_policy[0].instances_distribution[0].on_demand_percentage_above_base_capacity == 0 && aws_autoscaling_group.training.mixed_instances_policy[0].instances_distribution[0].on_demand_base_capacity == 0
    error_message = "every instance must be spot"
  }

  assert {
    condition     = aws_autoscaling_group.training.capacity_rebalance == true
    error_message = "capacity_rebalance must be on"
  }

  assert {
    condition     = length(aws_autoscaling_group.training.mixed_instances_policy[0].launch_template[0].override) == 5
    error_message = "every instance type must be an override"
  }

  assert {
    condition     = aws_autoscaling_group.training.desired_capacity == 1 && aws_autoscaling_group.training.max_size == 1
    error_message = "the group must hold one node by default"
  }
}

run "launch_template" {
  command = plan

  assert {
    condition     = aws_launch_template.training.metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 must be required"
  }

  assert {
    condition     = aws_launch_template.training.metadata_options[0].http_put_response_hop_limit == 2
    error_message = "the hop limit must be 2 so containers reach IMDSv2"
  }

  assert {
    condition     = aws_launch_template.training.block_device_mappings[0].ebs[0].encrypted == "true"
    error_message = "the root volume must be encrypted"
  }

  assert {
    condition     = length(regexall("--cloud \"\\$CLOUD\"", base64decode(aws_launch_template.training.user_data))) == 2 && strcontains(base64decode(aws_launch_template.training.user_data), "CLOUD='aws'")
    error_message = "the user data must run spotguard watch for aws"
  }

  assert {
    condition     = strcontains(base64decode(aws_launch_template.training.user_data), "export SPOTGUARD_CHECKPOINT_DIR='s3://") && strcontains(base64decode(aws_launch_template.training.user_data), "s3://llm-run-ckpt-test/llm-run'")
    error_message = "the user data must export the s3 checkpoint dir of the job's prefix"
  }

  assert {
    condition     = strcontains(base64decode(aws_launch_template.training.user_data), "TRAIN_ARGS=('--steps' '1000' )")
    error_message = "the training arguments must reach the user data"
  }
}

run "checkpoint_bucket" {
  command = plan

  assert {
    condition = alltrue([
      aws_s3_bucket_public_access_block.checkpoints.block_public_acls,
      aws_s3_bucket_public_access_block.checkpoints.block_public_policy,
      aws_s3_bucket_public_access_block.checkpoints.ignore_public_acls,
      aws_s3_bucket_public_access_block.checkpoints.restrict_public_buckets,
    ])
    error_message = "the bucket must block every kind of public access"
  }

  assert {
    condition     = one(one(aws_s3_bucket_server_side_encryption_configuration.checkpoints.rule).apply_server_side_encryption_by_default).sse_algorithm == "aws:kms"
    error_message = "the bucket must encrypt with KMS"
  }

  assert {
    condition     = aws_s3_bucket_versioning.checkpoints.versioning_configuration[0].status == "Enabled"
    error_message = "the bucket must be versioned"
  }

  assert {
    condition     = [for r in aws_s3_bucket_lifecycle_configuration.checkpoints.rule : r.abort_incomplete_multipart_upload[0].days_after_initiation if r.id == "abort-incomplete-uploads"] == [1]
    error_message = "incomplete multipart uploads must be aborted after a day"
  }

  assert {
    condition     = length(aws_fis_experiment_template.spot_interruption) == 0
    error_message = "the drill must be off by default"
  }
}

run "fis_drill" {
  command = plan

  variables {
    enable_fis_drill = true
  }

  assert {
    condition     = [for a in aws_fis_experiment_template.spot_interruption[0].action : a.action_id] == ["aws:ec2:send-spot-instance-interruptions"]
    error_message = "the drill must send a spot interruption"
  }

  assert {
    condition     = [for t in aws_fis_experiment_template.spot_interruption[0].target : "${t.resource_type} ${t.selection_mode}"] == ["aws:ec2:spot-instance COUNT(1)"]
    error_message = "the drill must interrupt one spot instance"
  }
}

run "rejects_bad_instance_types" {
  command = plan

  variables {
    instance_types = []
  }

  expect_failures = [var.instance_types]
}
