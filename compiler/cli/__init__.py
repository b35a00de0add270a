"""Command lines and local launchers: python -m zeroc demo|explain|tune and N local ranks."""
