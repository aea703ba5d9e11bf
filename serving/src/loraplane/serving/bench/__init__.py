"""`loraplane bench`: drive a server with a Zipf trace over adapters and tenants, report latencies and tiers."""
