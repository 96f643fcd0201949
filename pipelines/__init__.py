"""The built-in recipes (TOML) and their calibration texts: data, shipped as quantprep.pipelines (pyproject.toml)."""
