"""Registered machine translation models (`mt.<module>.<Class>`), e.g. the GPipe paper's
multilingual Transformers in `mt.multilingual`."""
