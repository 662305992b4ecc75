"""Local Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok) for tests."""
