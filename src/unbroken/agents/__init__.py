"""`unbroken run -- <agent> [args...]` for Codex CLI, Claude Code and any other command.

Each agent module turns the user's own set-up (config files, environment) into a
`Launch`: the routes a private relay needs, and the environment variables and
arguments that point the agent at it, without touching the user's files.
`launcher` starts the relay and the agent, `child` runs the agent's process.
OpenCode has its own (`unbroken.opencode.run`); `unbroken run` sends OpenCode
command lines there.
"""
