locals {
  checkpoint_prefix = var.checkpoint_prefix != "" ? var.checkpoint_prefix : var.name
  # az://<container>/<prefix>; the account comes from AZURE_STORAGE_ACCOUNT, the identity from AZURE_CLIENT_ID.
  checkpoint_dir = "az://${azurerm_storage_container.checkpoints.name}/${local.checkpoint_prefix}"
  tags           = merge(var.tags, { "spotguard-job" = var.name })
}

module "startup" {
  source = "../spotguard-startup"

  cloud          = "azure"
  job_name       = var.name
  checkpoint_dir = local.checkpoint_dir
  nodes          = var.nodes
  job            = var.job
  environment = merge({
    AZURE_STORAGE_ACCOUNT = azurerm_storage_account.checkpoints.name
    AZURE_CLIENT_ID       = azurerm_user_assigned_identity.training.client_id
  }, var.environment)
}

resource "azurerm_user_assigned_identity" "training" {
  name                = "${var.name}-training"
  resource_group_name = var.resource_group_name
  location            = var.location
  tags                = local.tags
}

resource "azurerm_linux_virtual_machine_scale_set" "training" {
  name                            = var.name
  resource_group_name             = var.resource_group_name
  location                        = var.location
  sku                             = var.vm_size
  instances                       = var.nodes
  priority                        = "Spot"
  eviction_policy                 = var.eviction_policy
  max_bid_price                   = -1 # pay up to the on-demand price: evictions for capacity only, never for price
  admin_username                  = var.admin_username
  disable_password_authentication = true
  custom_data                     = base64encode(module.startup.script)
  upgrade_mode                    = "Manual"
  overprovision                   = false
  encryption_at_host_enabled      = var.encryption_at_host
  tags                            = local.tags
  #checkov:skip=CKV_AZURE_97:encryption at host needs a subscription feature registration; turn it on with encryption_at_host

  admin_ssh_key {
    username   = var.admin_username
    public_key = var.admin_ssh_public_key
  }

  source_image_reference {
    publisher = var.source_image.publisher
    offer     = var.source_image.offer
    sku       = var.source_image.sku
    version   = var.source_image.version
  }

  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "Premium_LRS"
    disk_size_gb         = var.os_disk_size_gb
  }

  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.training.id]
  }

  network_interface {
    name    = "${var.name}-nic"
    primary = true

    ip_configuration {
      name      = "internal"
      primary   = true
      subnet_id = var.subnet_id
    }
  }

  # Scale-in deletes also get a Scheduled Event (Terminate), so spotguard saves then too.
  termination_notification {
    enabled = true
    timeout = "PT5M"
  }
}
