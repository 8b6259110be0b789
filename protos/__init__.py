"""Protocol buffer definitions and their generated gRPC stubs."""
