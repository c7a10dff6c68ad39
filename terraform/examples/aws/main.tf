provider "aws" {
  region = var.region
}

module "training" {
  source = "../../modules/aws-spot-training"

  name             = var.name
  subnet_ids       = var.subnet_ids
  instance_types   = var.instance_types
  enable_fis_drill = var.enable_fis_drill

  job = {
    code_repo_url = var.code_repo_url
    train_script  = "examples/train_ddp.py"
    train_args    = ["--steps", tostring(var.steps)]
  }
}
