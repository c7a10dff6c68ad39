provider "google" {
  project = var.project_id
  region  = var.region
}

module "training" {
  source = "../../modules/gcp-spot-training"

  name            = var.name
  project_id      = var.project_id
  zone            = var.zone
  bucket_location = upper(var.region)
  subnetwork      = var.subnetwork

  job = {
    code_repo_url = var.code_repo_url
    train_script  = "examples/train_ddp.py"
    train_args    = ["--steps", tostring(var.steps)]
  }
}
