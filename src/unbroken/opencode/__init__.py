"""The OpenCode integration: config discovery, the providers table, ``unbroken run --
opencode``, ``unbroken opencode setup/undo``, and auto-resume.

* `discovery`  OpenCode's config files and the providers in use, with their real URLs;
* `run`        ``unbroken run`` (OpenCode here, any other agent in `unbroken.agents`);
* `setup`      ``unbroken opencode setup/undo``;
* `providers`  OpenCode's provider table: which upstream each provider id relays to;
* `resume`     follows OpenCode's /event stream and resumes turns cut after output;
* `jsonc`      JSONC reading and byte-preserving editing of ``opencode.json``.
"""
