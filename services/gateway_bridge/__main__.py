from services.gateway_bridge.service import main

main()
