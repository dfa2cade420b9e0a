"""`atomc bench`: a streaming benchmark client for OpenAI-compatible servers and a CVS-style
sweep runner that gates each cell against a threshold file."""
