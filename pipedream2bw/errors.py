"""The package's exception for bad user input; imports nothing, so torch-free tools can raise and catch it."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the value, why, and the fix."""
