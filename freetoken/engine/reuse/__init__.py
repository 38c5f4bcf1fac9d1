"""KV reuse: the radix prefix cache of K/V blocks (:mod:`.prefix_cache`), anchors (named, verified, restorable
prefixes; :mod:`.anchors`), linear-attention state snapshots (:mod:`.state_cache`) and the model fingerprint an
anchor must match (:mod:`.fingerprint`)."""
