"""When a request may go: retry policy (`policy`), the per-upstream pacer (`pacer`),
rate-limit budgets (`ratelimit`, `ratehead`, `throttle`), upstream health (`health`)
and the schema of what a fleet shares (`shared`)."""
