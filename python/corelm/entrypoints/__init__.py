"""The ways in to the engine: `corelm serve` (server/, an OpenAI-compatible HTTP server) and
`corelm batch` (batch/, OpenAI Batch files through worker processes). Both speak corelm.openai."""
