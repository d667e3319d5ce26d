"""What every service process shares, below the services and above the engine: server
start-up, health and drain (`kvmesh.runtime.service`, `kvmesh.runtime.lifecycle`; the model services'
shared start-up steps, `kvmesh.runtime.model_start`), tracing, logs, flags and settings, and the
wire helpers that turn failures into gRPC statuses. It imports no service and no app module."""
