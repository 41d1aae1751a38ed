"""Built-in playbooks (YAML data shipped with the package)."""
