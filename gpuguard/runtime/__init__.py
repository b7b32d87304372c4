"""Runtime: asyncio orchestration of gather, decide, act and publish."""
