"""Security tests: TLS and mutual TLS, bearer tokens and tenants, limits and quotas, fuzzing, no deserialization."""
