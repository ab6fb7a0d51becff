"""Ways to run the speech server as many replicas: `higgs_rt.deploy.ray` (Ray Serve, the `ray` extra). The
Kubernetes manifests live in the repository's deploy/kubernetes/, beside the server image."""
