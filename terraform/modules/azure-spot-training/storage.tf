resource "random_string" "account_suffix" {
  length  = 6
  upper   = false
  special = false
}

resource "azurerm_storage_account" "checkpoints" {
  # 3-24 lowercase letters and digits, globally unique.
  name                            = "${substr(replace(var.name, "-", ""), 0, 12)}ckpt${random_string.account_suffix.result}"
  resource_group_name             = var.resource_group_name
  location                        = var.location
  account_kind                    = "StorageV2"
  account_tier                    = "Standard"
  account_replication_type        = var.storage_replication_type
  min_tls_version                 = "TLS1_2"
  https_traffic_only_enabled      = true
  allow_nested_items_to_be_public = false
  shared_access_key_enabled       = false # Entra ID (managed identity) only
  local_user_enabled              = false
  tags                            = local.tags
  #checkov:skip=CKV_AZURE_59:the network rules below admit only the job's subnet; a private endpoint is left to the caller
  #checkov:skip=CKV2_AZURE_33:a private endpoint is left to the caller; the network rules admit only the job's subnet
  #checkov:skip=CKV2_AZURE_1:checkpoints are encrypted with Microsoft-managed keys; bring a CMK through your own policy
  #checkov:skip=CKV_AZURE_206:ZRS by default survives a zone outage; geo-replicating working checkpoints doubles cost (storage_replication_type)
  #checkov:skip=CKV_AZURE_33:the account holds blobs only; queue logging has nothing to log

  blob_properties {
    versioning_enabled = true

    delete_retention_policy {
      days = var.noncurrent_version_retention_days
    }

    container_delete_retention_policy {
      days = var.noncurrent_version_retention_days
    }
  }

  network_rules {
    default_action             = "Deny"
    bypass                     = ["AzureServices"]
    virtual_network_subnet_ids = [var.subnet_id]
  }

  sas_policy {
    expiration_period = "01.00:00:00"
  }
}

resource "azurerm_storage_container" "checkpoints" {
  name                  = "checkpoints"
  storage_account_id    = azurerm_storage_account.checkpoints.id
  container_access_type = "private"
  #checkov:skip=CKV2_AZURE_21:blob read logging needs a diagnostic setting and a Log Analytics workspace, left to the caller
}

# Old versions of pruned or overwritten checkpoint blobs go after the retention period.
# (Uncommitted blocks of an interrupted upload are garbage-collected by Azure after 7 days.)
resource "azurerm_storage_management_policy" "checkpoints" {
  storage_account_id = azurerm_storage_account.checkpoints.id

  rule {
    name    = "expire-pruned-steps"
    enabled = true

    filters {
      blob_types   = ["blockBlob"]
      prefix_match = ["${azurerm_storage_container.checkpoints.name}/${local.checkpoint_prefix}/"]
    }

    actions {
      version {
        delete_after_days_since_creation = var.noncurrent_version_retention_days
      }
    }
  }
}

# The VMs' identity may read and write blobs of this container only.
resource "azurerm_role_assignment" "training" {
  scope                = azurerm_storage_container.checkpoints.id
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = azurerm_user_assigned_identity.training.principal_id
}
