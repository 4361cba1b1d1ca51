"""Every line of vamp-sglang that imports SGLang lives in this package."""
