"""The module graph: Variables, Modules and their structure (`GraphDef`), static attribute
values, hooks, the cached flatten of a graph, selectors, `State`s and walking a model."""
