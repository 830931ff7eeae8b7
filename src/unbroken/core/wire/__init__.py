"""The wire: the SSE splitter (`sse`), each protocol's classifier tables (`protocols`),
and what is kept out of logs and answers (`redact`)."""
