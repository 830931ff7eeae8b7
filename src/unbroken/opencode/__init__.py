"""The OpenCode integration: config discovery, the providers table, the launcher
(``unbroken run -- opencode``), ``unbroken opencode setup/undo``, and auto-resume.

* `launcher`   ``unbroken run``, ``unbroken opencode setup/undo``;
* `providers`  OpenCode's provider table: which upstream each provider id relays to;
* `resume`     follows OpenCode's /event stream and resumes turns cut after output;
* `jsonc`      JSONC reading and byte-preserving editing of ``opencode.json``.
"""
