provider "azurerm" {
  features {}
  # The storage account allows Entra ID only (no shared keys).
  storage_use_azuread = true
}

resource "azurerm_resource_group" "training" {
  name     = "${var.name}-rg"
  location = var.location
}

resource "azurerm_virtual_network" "training" {
  name                = "${var.name}-vnet"
  resource_group_name = azurerm_resource_group.training.name
  location            = azurerm_resource_group.training.location
  address_space       = ["10.42.0.0/16"]
}

resource "azurerm_subnet" "training" {
  name                 = "training"
  resource_group_name  = azurerm_resource_group.training.name
  virtual_network_name = azurerm_virtual_network.training.name
  address_prefixes     = ["10.42.1.0/24"]
  service_endpoints    = ["Microsoft.Storage"]
}

resource "azurerm_network_security_group" "training" {
  name                = "${var.name}-nsg"
  resource_group_name = azurerm_resource_group.training.name
  location            = azurerm_resource_group.training.location
}

resource "azurerm_subnet_network_security_group_association" "training" {
  subnet_id                 = azurerm_subnet.training.id
  network_security_group_id = azurerm_network_security_group.training.id
}

# Outbound internet for pip: VMs in a scale set without public IPs need a NAT gateway.
resource "azurerm_public_ip" "nat" {
  name                = "${var.name}-nat-ip"
  resource_group_name = azurerm_resource_group.training.name
  location            = azurerm_resource_group.training.location
  allocation_method   = "Static"
  sku                 = "Standard"
}

resource "azurerm_nat_gateway" "training" {
  name                = "${var.name}-nat"
  resource_group_name = azurerm_resource_group.training.name
  location            = azurerm_resource_group.training.location
  sku_name            = "Standard"
}

resource "azurerm_nat_gateway_public_ip_association" "training" {
  nat_gateway_id       = azurerm_nat_gateway.training.id
  public_ip_address_id = azurerm_public_ip.nat.id
}

resource "azurerm_subnet_nat_gateway_association" "training" {
  subnet_id      = azurerm_subnet.training.id
  nat_gateway_id = azurerm_nat_gateway.training.id
}

module "training" {
  source = "../../modules/azure-spot-training"

  name                 = var.name
  resource_group_name  = azurerm_resource_group.training.name
  location             = azurerm_resource_group.training.location
  subnet_id            = azurerm_subnet.training.id
  admin_ssh_public_key = var.admin_ssh_public_key

  job = {
    code_repo_url = var.code_repo_url
    train_script  = "examples/train_ddp.py"
    train_args    = ["--steps", tostring(var.steps)]
  }

  depends_on = [azurerm_subnet_nat_gateway_association.training]
}
