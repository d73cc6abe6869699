"""The `kvstrata replay --json` contract, written down once from the issue (not from the code)."""

REQUIRED_JSON_KEYS = {
    "requests",
    "tokens",
    "hit_rate",
    "bytes",
    "corrupt_pages_detected",
    "corrupt_pages_served",
    "failures",
    "wall_s",
    "tokens_per_s",
}
