"""Server-side tools.

base        Tool, ToolContext, ToolError (ToolCall is pipeline.answer.events')
registry    the tools by name; argument parsing and schema checks
invoker     one round of calls at once: spans, timeouts, concurrency and rate limits
calculator  clock  builtins  http     the tools themselves
planner     the calls a request plainly needs (planned tools)
loop        the function-calling flow (model, tools, model again)
offer       which tools a request offers the model
access      which tools each tenant may use
"""
