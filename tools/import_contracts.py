"""import-linter contract types of our own (pyproject's ``[tool.importlinter]``).

``allow_only``: the modules of ``source_modules`` (their descendants included)
import nothing but one another, the standard library, and ``allowed_modules``.
It is an allow-list: a new dependency of the sans-IO core fails it until it is
named here, where the deny-list it replaces let any library it did not list in.
"""

from __future__ import annotations

import sys
from typing import Any

from importlinter import Contract, ContractCheck, fields, output


class AllowOnlyContract(Contract):
    type_name = "allow_only"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        sources: list[str] = list(self.source_modules)  # type: ignore[call-overload]
        allowed: set[str] = set(self.allowed_modules or ())  # type: ignore[arg-type]
        modules = set(sources)
        for source in sources:
            modules |= graph.find_descendants(source)
        bad: list[dict[str, Any]] = []
        for importer in sorted(modules):
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                top = imported.split(".")[0]
                if imported in modules or top in allowed or top in sys.stdlib_module_names:
                    continue
                details = graph.get_import_details(importer=importer, imported=imported)
                lines = [(d["line_number"], d["line_contents"]) for d in details]
                bad.append({"importer": importer, "imported": imported, "lines": lines})
        return ContractCheck(kept=not bad, metadata={"bad": bad})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for item in check.metadata["bad"]:
            output.print_error(f"{item['importer']} is not allowed to import {item['imported']}:")
            for number, text in item["lines"] or [("?", "")]:
                output.indent_cursor()
                output.print_error(f"{item['importer']}:{number}: {text}", bold=False)
            output.new_line()
