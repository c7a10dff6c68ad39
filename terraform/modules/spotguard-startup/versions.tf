terraform {
  # Renders a script only: no provider, so it plans and tests anywhere.
  required_version = ">= 1.7.0"
}
