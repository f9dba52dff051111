"""The OpenAI-compatible API independent of its transport: request and response models (protocol),
request -> engine work (prepare), engine results -> response bodies (responses), and the one error
envelope (errors). The HTTP server and the batch runner both build on it; neither imports the other."""
