"""The decision at every KV shortfall and at restores, with the measurements and peers it reads."""
